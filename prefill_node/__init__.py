"""The prefill node: its scheduler (bootstrap -> waiting -> chunked -> (parked) -> inflight), its part of the
node process, and its launcher; the rest of the node is ``common.node``'s.

Public API: ``prefill_node.__main__.main(argv) -> int`` (the ``pdcluster prefill`` command),
``PrefillScheduler`` (prefill_node.scheduler), ``PrefillPart`` (prefill_node.process).
"""
