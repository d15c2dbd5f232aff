"""Generated from protos/tokenspout/v1 by `make proto`; do not edit the *_pb2* files."""
