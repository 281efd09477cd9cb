"""Generated protobuf/gRPC code for buf (scripts/generate_protos.py)."""
