"""Generated gRPC code of the sidecar's control API (see ``sidecar.proto``).

Regenerate with ``hack/gen-proto.sh``; never edit the ``*_pb2*`` files by hand.
"""
