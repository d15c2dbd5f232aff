# google.rpc's status.proto and error_details.proto, which the Java and C++ examples generate code
# for: copied from the pinned googleapis-common-protos in the venv, the same ones the server sends
# (Debian's libgoogle-common-protos-java 1.16 predates ErrorInfo; C++ has no packaged copy).
PYTHON ?= $(ROOT)/.venv/bin/python
GOOGLE_RPC_PROTOS := $(ROOT)/build/clients/google-rpc-protos

# Copied again when the client package's pins (googleapis-common-protos among them) change.
$(GOOGLE_RPC_PROTOS)/google/rpc/error_details.proto: $(ROOT)/clients/python/pyproject.toml
	mkdir -p $(@D)
	source=$$($(PYTHON) -c 'import pathlib, google.rpc.status_pb2 as m; print(pathlib.Path(m.__file__).parent)') \
	  && cp "$$source/status.proto" "$$source/error_details.proto" $(@D)/
