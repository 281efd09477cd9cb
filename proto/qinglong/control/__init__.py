"""Generated protobuf/gRPC code for qinglong.control (scripts/generate_protos.py)."""
