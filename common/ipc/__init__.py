"""The link between a node's API process and its scheduler process, both halves in one place.

::

    API process                                  scheduler process
    scheduler_client.SchedulerClient  <== ZMQ ipc ==>  node_io.NodeIO
      (asyncio; per-request queues,                    (non-blocking recv/send once per step;
       wire rids, liveness watchdog)                    queries answered between two steps)
                        \\                            /
                         protocol: the tagged msgspec messages both ends speak
                         (GenerateReq, AbortReq, QueryReq, FlushCacheReq -> scheduler;
                          BatchOutput of ReqOutput, QueryReply -> API) and IpcEndpoints

Nothing here knows a role: both node roles use the same link.
"""
