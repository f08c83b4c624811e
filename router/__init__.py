"""The router: the protocols' edge of the cluster, in two wings over one request path.

server.py        the host: RouterServer mounts the protocols (epcluster.v1 always, serve_vllm,
                 serve_http), health, reflection; serve() -> a started RouterServer
api/             the protocol front ends (each maps only its own wire fields):
  v1_grpc.py       the epcluster.v1.Inference servicer; convert.py its protobuf <-> dataclasses
  openai_http.py   OpenAI-compatible HTTP (FastAPI): openai_requests.py its bodies,
                   openai_views.py its JSON and SSE, http_auth.py its token and TLS
  vllm_grpc.py     vLLM's engine gRPC protocol (vllm.grpc.engine.VllmEngine) for gateways;
                   abort_scope.py who may Abort what
  grpc_service.py  registers a service so that an unparsable request is INVALID_ARGUMENT
frontend.py      the one request path of every protocol (admission, readiness, aborts)
requests.py      the one request builder every protocol calls (id, prompt, limits, stop ids,
                 seed, deadline)
backend.py       the Backend protocol the front end drives
backends/        what serves requests, and the cluster's control plane:
  local.py         LocalBackend: one LLMEngine on a background thread
  cluster.py       ClusterBackend over a prefill and a decode pool, made of route_table.py (the
                   requests in flight), reservations.py (KV reservations on decode ranks),
                   decode_streams.py, lease_renewer.py and cluster_admin.py (status,
                   rebalances, expert load, service discovery)
  ranks.py         the rank Protocols; attempt_errors.py how an attempt ends without a
                   failure; attempt_waits.py how it waits (deadline, abort, re-forming pools)
  pools.py         the health watch and re-forming; routing.py where a request goes
                   (RoutingConfig); decode_room.py the decode ranks' free blocks and waiters
admission.py     caps on admitted requests and their prompt tokens
auth.py          TLS, mutual TLS and the bearer token: server side and client channels
client.py        InferenceClient, AsyncInferenceClient (epcluster.v1)
metrics.py       the router's Prometheus metrics
proto/           epcluster.proto and its generated code (generate.sh)

Imports point down: server -> api -> frontend, requests -> backend; backends -> backend;
backends never import api, and nothing below imports server.
"""
