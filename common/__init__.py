"""What both node roles run: config, protocol, requests, KV memory, engine, models, server."""
