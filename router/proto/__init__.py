"""dsv3serve's gRPC API (``generate.proto``) and its generated Python modules.

The ``*_pb2*.py`` files are generated and committed; after editing the .proto, run
``python -m router.proto.compile`` (needs ``grpcio-tools``).
"""
