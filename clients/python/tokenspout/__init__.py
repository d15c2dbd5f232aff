"""Python client for tokenspout: generated stubs in `tokenspout.v1`, a small client in `tokenspout.client`."""
