"""Generated protobuf/gRPC code for qinglong.worker (scripts/generate_protos.py)."""
