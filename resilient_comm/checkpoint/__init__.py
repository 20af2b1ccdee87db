"""Async tiered checkpoint: snapshot to host memory off the training thread, flush to local disk
in the background, restore the newest checkpoint that verifies.

Tiers. ``save()`` returns at once; a background thread copies every tensor of the state into
host buffers that are reused from save to save (pinned memory for CUDA tensors, copied on a
side stream), then writes the host copy to local disk with ``torch.save``. The training thread
is blocked only for the walk of the state's containers in ``save()`` and, when the copy is not
done yet, in ``wait_snapshot()``; measure it with ``resilient-comm bench checkpoint``.

Layout (``docs/checkpoint.md``)::

    {directory}/step-{step:08d}/rank-{rank:05d}.pt     torch.save of the host copy
    {directory}/step-{step:08d}/rank-{rank:05d}.json   manifest: step, rank, bytes, sha256

``rank`` is a mesh position, not a process: a hot spare that takes rank 3's place reads
``rank-00003.pt``. A step directory is shared by every rank of the job on the host; each rank
writes, prunes and cleans only its own files.

Durability. The data file is written as ``.rank-R.pt.tmp-PID``, fsynced, renamed into place;
then the manifest (size and SHA-256 of the data file, computed while writing) goes through the
same tmp + fsync + rename, and the step directory is fsynced. The manifest is the commit point:
a rank file without one, or whose size or checksum differs from it, is not a checkpoint. A
process killed at any point leaves the previous checkpoints untouched; its tmp files are
removed by the next checkpointer of the same rank once the writer's pid is gone.

Restore. ``load()`` tries this rank's checkpoints newest first, verifies size and checksum, and
reads the file with ``torch.load(weights_only=True)`` (no arbitrary unpickling); a checkpoint
that fails is logged with the file and the reason, and the previous one is tried.
:func:`latest_complete` finds the newest step every rank of a job can restore.

Interval. :class:`IntervalAdvisor` turns the measured stall and flush time, the failure rate and
the restart time into a checkpoint interval (Young/Daly).

Modules: :mod:`.layout` (file names, verification, durable writing, pruning), :mod:`.snapshot`
(the host-copy plan of a state), :mod:`.writer` (:class:`AsyncCheckpointer` and its threads),
:mod:`.interval` (the Young/Daly formulas and the advisor; no torch, the failure simulator
imports it). Every module logs to the ``resilient_comm.checkpoint`` logger.
"""

from __future__ import annotations

from resilient_comm.checkpoint.interval import (
    IntervalAdvice,
    IntervalAdvisor,
    daly_interval,
    expected_waste,
    first_order_waste,
    job_mtbf_s,
    young_interval,
)
from resilient_comm.checkpoint.layout import (
    CheckpointError,
    latest_complete,
    manifest_file,
    rank_file,
    step_dir,
    verify,
)
from resilient_comm.checkpoint.writer import AsyncCheckpointer, CheckpointStats, SaveRecord

__all__ = [
    "AsyncCheckpointer",
    "CheckpointError",
    "CheckpointStats",
    "IntervalAdvice",
    "IntervalAdvisor",
    "SaveRecord",
    "daly_interval",
    "expected_waste",
    "first_order_waste",
    "job_mtbf_s",
    "latest_complete",
    "manifest_file",
    "rank_file",
    "step_dir",
    "verify",
    "young_interval",
]
