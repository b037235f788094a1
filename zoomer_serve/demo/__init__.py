"""Demo model server: a DLRM-style ranking model behind the gRPC ``zoomer.demo.v1.Ranker`` service.

Modules (import them directly; this package imports nothing so that ``codegen`` runs without torch):

* ``model``: ``DLRMConfig``, ``DLRM``, ``build_model``, ``pick_device``, ``pack_sparse``;
* ``service``: ``RankerServicer``, ``ServiceConfig``, ``build_server``, ``InvalidRequestError``;
* ``load``: ``drive_load``, ``make_request``, ``InvalidKind``, ``LoadResult``;
* ``codegen``: regenerates ``ranker_pb2*.py`` from ``ranker.proto``.
"""
