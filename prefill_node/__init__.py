"""The prefill node: scheduler (bootstrap -> waiting -> chunked -> inflight), its process, and launch.

Public API: ``prefill_node.__main__.main(argv) -> int`` (the ``pdcluster prefill`` command),
``PrefillScheduler`` / ``PrefillSchedConfig`` (prefill_node.scheduler), ``run_scheduler``
(prefill_node.process).
"""
