"""What both node roles run around their scheduler, written once.

::

    launch.py     the launcher (API process): flags both roles take, the spawned scheduler child,
                  run_node() = registry/sidecar + child + wait for ready + API server + cleanup
    process.py    the scheduler process: NodeProcess = engine + transfer manager + NodeIO + the
                  loop, plus a role part (prefill_node/process.py, decode_node/process.py) that
                  builds the role's KV manager, scheduler and stats
    contract.py   the one contract both schedulers keep: step(msgs) -> outputs, and their stats
                  (RateMeter, which both roles' stats use, stays with NodeStats in common/ipc/node_io.py)

Each role package adds only what differs: its flags, its role part, its scheduler.
"""
