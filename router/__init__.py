"""The router: the gRPC edge of the cluster.

proto/           epcluster.proto and its generated code (generate.sh)
backend.py       the Backend protocol the server drives (LocalBackend; the Ray pools in cluster/)
local_backend.py LocalBackend: one LLMEngine on a background thread
admission.py     caps on admitted requests and their prompt tokens
convert.py       protobuf <-> engine dataclasses, request validation
server.py        InferenceServicer, health, reflection; serve() -> RouterServer
client.py        InferenceClient, AsyncInferenceClient
"""
