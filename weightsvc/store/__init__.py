"""Versions in an object store (S3 and what speaks its API): written through by the service
(`weightsvc.service.publish`), read back by the `s3://` client (`weightsvc.client._store`), a relay
following a store, and a server restoring from one. The objects and their names: `layout`.
"""

from weightsvc.store.layout import Marker
from weightsvc.store.reader import StoreReader
from weightsvc.store.s3 import Bucket, StoreUrl, is_store

__all__ = ["Bucket", "Marker", "StoreReader", "StoreUrl", "is_store"]
