// The one table of RESILIENT_COMM_* knobs. C++ reads them through env::get*(), Python
// through resilient_comm.config (which asks _C for this same table), and docs/configuration.md
// is generated from it (scripts/gen_knobs.py). Add a knob here and nowhere else.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace resilient_comm::env {

// X(enum name, variable name, default value as text, one-line description)
#define RC_KNOBS(X)                                                                              \
  X(kAlgo, "RESILIENT_COMM_ALGO", "auto",                                                        \
    "TCP collective algorithm: auto (alpha-beta cost model), ring, rd (log-depth), direct")      \
  X(kHost, "RESILIENT_COMM_HOST", "",                                                            \
    "address this rank publishes for TCP connections (default: the host name's IPv4 address)")   \
  X(kShm, "RESILIENT_COMM_SHM", "1",                                                            \
    "0: same-host TCP peers move payloads through the socket, not shared memory")                \
  X(kLiveness, "RESILIENT_COMM_LIVENESS", "1",                                                  \
    "0: no liveness lock: a same-host peer's or a worker's death is known only once the kernel closed its files") \
  X(kTcpFullMesh, "RESILIENT_COMM_TCP_FULL_MESH", "64",                                       \
    "TCP groups of at most this many ranks connect every pair at init; larger ones connect on first use") \
  X(kChunkBytes, "RESILIENT_COMM_CHUNK_BYTES", "262144",                                         \
    "pipelining chunk of the ring algorithms, in bytes")                                         \
  X(kAlphaUs, "RESILIENT_COMM_ALPHA_US", "25",                                                   \
    "cost model: latency of one message between two ranks, in microseconds")                     \
  X(kBandwidthGBps, "RESILIENT_COMM_BANDWIDTH_GBPS", "2.0",                                      \
    "cost model: bandwidth of one connection, in GB/s")                                          \
  X(kNcclLib, "RESILIENT_COMM_NCCL_LIB", "",                                                     \
    "path of the libnccl to load before trying the one torch loaded and the nvidia-nccl wheel")  \
  X(kNcclMultiRankGpu, "NCCL_MULTI_RANK_GPU_ENABLE", "0",                                        \
    "NCCL's own switch (2.30+): several ranks of a communicator on one GPU; read to report the cap") \
  X(kNcclEmulate, "RESILIENT_COMM_NCCL_EMULATE", "0",                                           \
    "1: resilient_nccl sends CPU tensors through its NCCL communicator on the NCCL emulator (tests, CI)") \
  X(kNcclEmulateVersion, "RESILIENT_COMM_NCCL_EMULATE_VERSION", "2.30.0",                        \
    "the NCCL version the emulator reports (its features follow: shrink 2.27, revoke 2.28.7, grow 2.29)") \
  X(kNcclEmulateLaunchUs, "RESILIENT_COMM_NCCL_EMULATE_LAUNCH_US", "20",                         \
    "emulator: how long after a call returns ncclInProgress its kernels reach the stream, in us") \
  X(kNcclEmulateKernelUs, "RESILIENT_COMM_NCCL_EMULATE_KERNEL_US", "0",                          \
    "emulator: device time of every kernel (at least), in us")                                  \
  X(kNcclEmulatePeerDeath, "RESILIENT_COMM_NCCL_EMULATE_PEER_DEATH", "error",                    \
    "emulator: a dead peer sets ncclRemoteError (error, as NCCL's network proxy) or only hangs the kernel (hang)") \
  X(kBlockingWait, "RESILIENT_COMM_BLOCKING_WAIT", "0",                                          \
    "1: Work.wait() on a device op waits on the host (as TORCH_NCCL_BLOCKING_WAIT=1), not only the stream") \
  X(kHcclLib, "RESILIENT_COMM_HCCL_LIB", "",                                                     \
    "path of the libhccl to load before libhccl.so from the default library search path")        \
  X(kWatchdogGraceMs, "RESILIENT_COMM_WATCHDOG_GRACE_MS", "250",                                 \
    "the watchdog aborts an op this long after its deadline if the transport has not failed it") \
  X(kAbortBoundMs, "RESILIENT_COMM_ABORT_BOUND_MS", "2000",                                      \
    "longest wait for a communicator abort; past it the process is marked tainted and goes on")  \
  X(kLogLevel, "RESILIENT_COMM_LOG_LEVEL", "warning", "debug, info, warning or error")           \
  X(kToken, "RESILIENT_COMM_TOKEN", "",                                                          \
    "the job's secret (resilient-run makes one per single-node job): TCP Hellos carry a MAC of it") \
  X(kHeartbeatMs, "RESILIENT_COMM_HEARTBEAT_MS", "100",                                          \
    "elastic: heartbeat period of every member, in ms")                                          \
  X(kNodeHeartbeatMs, "RESILIENT_COMM_NODE_HEARTBEAT_MS", "200",                                \
    "elastic: period of each node agent's liveness record in the store, in ms")                 \
  X(kNodeLeaseMs, "RESILIENT_COMM_NODE_LEASE_MS", "5000",                                       \
    "elastic, etcd: TTL of each node's lease; a node cut off from the store this long is fenced") \
  X(kJoinWindowMs, "RESILIENT_COMM_JOIN_WINDOW_MS", "50",                                       \
    "elastic: how long a node agent holds its workers' first join record for the others, in ms") \
  X(kHealthCheck, "RESILIENT_COMM_HEALTH_CHECK", "",                                             \
    "elastic: resilient-run's --health-check when none is given: a shell command, or builtin:accelerator") \
  X(kSilenceFloorMs, "RESILIENT_COMM_SILENCE_FLOOR_MS", "1000",                                  \
    "elastic: a silent heartbeat is suspected past max(this, slow factor x its p99 step + comm)") \
  X(kStragglerFloorMs, "RESILIENT_COMM_STRAGGLER_FLOOR_MS", "5000",                              \
    "elastic: a rank computing while others wait is suspected past max(this, the same bound)")   \
  X(kSlowFactor, "RESILIENT_COMM_SLOW_FACTOR", "10",                                             \
    "elastic: the dead-vs-slow bound's multiple of a rank's own p99 step time")                  \
  X(kFingerprintEvery, "RESILIENT_COMM_FINGERPRINT_EVERY", "100",                                \
    "elastic: the dp replicas compare a fingerprint of their state every this many steps (0: never)") \
  X(kPaceWindow, "RESILIENT_COMM_PACE_WINDOW", "0",                                            \
    "elastic: fail-slow detection compares the members' compute every this many steps (0: off; try 20)") \
  X(kEtcdProtocol, "RESILIENT_COMM_ETCD_PROTOCOL", "",                                          \
    "elastic, etcd: http or https (default: https when the endpoints say https:// or a TLS file is set)") \
  X(kEtcdCacert, "RESILIENT_COMM_ETCD_CACERT", "",                                              \
    "elastic, etcd: CA bundle (PEM) etcd's certificate must chain to (default: the system's); --rdzv-conf cacert=") \
  X(kEtcdCert, "RESILIENT_COMM_ETCD_CERT", "",                                                  \
    "elastic, etcd: client certificate (PEM, with no CN: docs/security.md); --rdzv-conf cert=")  \
  X(kEtcdKey, "RESILIENT_COMM_ETCD_KEY", "",                                                    \
    "elastic, etcd: the client certificate's private key (PEM); --rdzv-conf key=")               \
  X(kEtcdUser, "RESILIENT_COMM_ETCD_USER", "",                                                  \
    "elastic, etcd: the etcd user the job logs in as, on a cluster with auth enabled; --rdzv-conf user=") \
  X(kEtcdPasswordFile, "RESILIENT_COMM_ETCD_PASSWORD_FILE", "",                                 \
    "elastic, etcd: file holding that user's password (workers get its path); --rdzv-conf password_file=") \
  X(kEtcdPassword, "RESILIENT_COMM_ETCD_PASSWORD", "",                                          \
    "elastic, etcd: that user's password, where no file is given (never a flag; never logged or stored)")

enum class Knob {
#define RC_KNOB_ENUM(id, name, dflt, doc) id,
  RC_KNOBS(RC_KNOB_ENUM)
#undef RC_KNOB_ENUM
};

struct KnobInfo {
  const char* name;
  const char* defaultValue;
  const char* doc;
};

const std::vector<KnobInfo>& allKnobs();
const KnobInfo& info(Knob knob);

// The variable's value, or its default when unset or empty.
std::string getString(Knob knob);
// Parsed as a number; a malformed value is reported once on stderr and the default used.
int64_t getInt(Knob knob);
double getDouble(Knob knob);

}  // namespace resilient_comm::env
