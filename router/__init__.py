"""The router: the gRPC edge of the cluster.

proto/           epcluster.proto and its generated code (generate.sh)
backend.py       the Backend protocol the server drives (LocalBackend; the Ray pools in cluster/)
local_backend.py LocalBackend: one LLMEngine on a background thread
admission.py     caps on admitted requests and their prompt tokens
convert.py       protobuf <-> engine dataclasses, request validation
frontend.py      the one request path of every protocol (admission, readiness, aborts)
server.py        InferenceServicer, health, reflection; serve() -> RouterServer
openai_http.py   OpenAI-compatible HTTP (FastAPI), openai_views.py its JSON and SSE
vllm_grpc.py     vLLM's engine gRPC protocol (vllm.grpc.engine.VllmEngine) for gateways
grpc_service.py  registers a service so that an unparsable request is INVALID_ARGUMENT
auth.py          TLS, mutual TLS and the bearer token: server side and client channels
client.py        InferenceClient, AsyncInferenceClient
cluster_backend.py the Backend over the pools, made of: route_table.py (requests in flight),
                 decode_streams.py, lease_renewer.py, cluster_admin.py (status, rebalances,
                 expert load, service discovery); ranks.py the rank Protocols, pools.py the
                 health watch and re-forming, routing.py where a request goes (RoutingConfig)
metrics.py       the router's Prometheus metrics
"""
