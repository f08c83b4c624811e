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
cluster_backend.py, pools.py, routing.py: the Backend over the Ray pools (health, re-forming);
                 cluster_types.py its rank handles, settings and request state,
                 cluster_admin.py its status, rebalances, expert load and service discovery
metrics.py       the router's Prometheus metrics
"""
