"""One engine process per engine slot of a machine, serving every engine job the machine runs.

A machine's jobs (golden replay, fast-pass shards, reason shards) are short client processes, each
under the worker protocol (heartbeat, marker, salvage). Instead of loading an engine themselves they
hand their work to the slot's engine host, which loads each engine once and stays up between jobs, so
a machine pays one engine start per slot instead of one per job:

    python -m jex.tasks.execution.engine_host serve LAUNCH   (started by the golden job, or the first client
                                                         that finds none listening; LAUNCH: a HostLaunch)

`protocol` holds what crosses the boundaries: `HostOptions` (how a job uses the machine's hosts: what
`jex stage run|golden --host-options` reads), the launch record, the socket's request and reply, the
progress and start records, the socket's address and key. `server` is the host, `client` a job's side
(starting hosts, asking them, watching them stall). The compile cache a host restores before its
engine start and packs after it is `jex.engine.compile_cache`.

`HOME/slot-S/` holds the host's log, pid file (`host.pgid`: the machine's teardown and its watchdog
stop it with the jobs), progress record (`progress.json`) and vLLM compile cache (`vllm-cache/`);
`HOME/authkey` authenticates clients on the host's socket. Every engine start is appended to
`HOME/starts.jsonl`, which the orchestrator reads into `machines.json`. A host holds one engine at a
time. Engines start together, except those that size their memory by profiling the GPU (vLLM without
a fixed KV cache): vLLM engines that profile together on one GPU each count the other's memory as
their own, so those take turns under a machine-wide lock (their imports happen before it).

With hosts kept up for every job (`HostOptions.max_requests` 0), the golden job starts every slot's
host (`prestart`), so a machine's engines are up when its first stage job arrives. A host accepts
connections on a thread and serves them one at a time; what it runs for a stage request is
`jex.tasks.execution.engine_job.run_engine_job`.

A host that dies during a request: the client starts a new host and asks once more (shards
already written are reused), then gives up and the job fails under its marker. A host that stays
alive but makes no progress (no finished shard for `stall_s`, no finished start for
`START_STALL_S`: a hung kernel, a deadlock) is stopped by the waiting client and treated as dead.
A request that fails inside a live host is reported to the client, and the host exits after
replying, so the next job starts from a fresh engine rather than one a CUDA error or a panic may
have left unusable.
"""

from jex.engine.compile_cache import COMPILE_CACHE
from jex.tasks.execution.engine_host.client import EngineHostDied, HostPolicy, prestart, run_request
from jex.tasks.execution.engine_host.protocol import STARTS, HostOptions, HostRequest, parse_starts

__all__ = ["COMPILE_CACHE", "STARTS", "EngineHostDied", "HostOptions", "HostPolicy", "HostRequest",
           "parse_starts", "prestart", "run_request"]
