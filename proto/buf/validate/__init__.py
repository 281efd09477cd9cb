"""Generated protobuf/gRPC code for buf.validate (scripts/generate_protos.py)."""
