"""The decode node: its scheduler (prealloc -> transfer -> waiting -> running), its part of the
node process, and its launcher; the rest of the node is ``common.node``'s."""
