"""What a training process runs: the `controller.Controller` around its training loop, or
`inprocess.restartable` around an unmodified script. Failure detection (`detector`), the
evidence a member holds (`evidence`), rejoining after a failure (`rejoin`), the commit
protocol (`commits`, its vote `commit_vote`), the process groups (`groups`), the
checkpoints (`checkpoints`), the recovery timelines (`timelines`), how a worker leaves
(`errors`) and the back-off of its polls (`pacer`).

Imports the model, the membership and the state; never the node agent's side (what both need
is in `model`).
"""
