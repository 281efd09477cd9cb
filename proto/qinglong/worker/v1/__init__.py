"""Generated protobuf/gRPC code for qinglong.worker.v1 (scripts/generate_protos.py)."""
