"""Generated protobuf/gRPC code for the QingLong wire contracts (see scripts/generate_protos.py)."""
