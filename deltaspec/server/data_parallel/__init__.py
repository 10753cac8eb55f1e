"""Data-parallel serving: N engine replicas, each an ordinary deltaspec server, behind one OpenAI-compatible front
door that routes each request by prefix affinity (`deltaspec serve --data-parallel-size N`).

Modules: `router` (the routing policy, no HTTP), `prompt_text` (the text a request is routed on), `front_door` (the
proxy app), `metrics` (its /metrics), `processes` (starting and stopping replica processes), `replica` (a replica's
program), `serve` (one host), `ray_serve` (a Ray cluster's hosts, with the optional ray extra).
"""
