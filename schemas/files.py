"""Where the OpenAI Files API keeps its files: two JetStream buckets, file storage.

- ``OBJECT_BUCKET``, an Object Store: each file's bytes, as the object ``<tenant>/<file id>``;
- ``METADATA_BUCKET``, a KV bucket: each file's record (OpenAI's file object, JSON), under
  the key ``<tenant key>.<file id>``, so that one tenant's files are listed by one subject
  filter (``<tenant key>.*``) without reading anyone else's.

A tenant (``[A-Za-z0-9._-]``) may hold a dot, which a KV key would read as a subject token
(tenant ``a`` would then list tenant ``a.b``'s files): ``tenant_key`` writes it with ``=``
instead, a character no tenant has, so that the mapping stays one to one.

The record is the file's commit point: written after the bytes, removed before them, so a
file that is listed can be read, and a crash between the two leaves bytes nobody lists.
"""

from __future__ import annotations

OBJECT_BUCKET = "switchyard_files"
METADATA_BUCKET = "switchyard_files_meta"
OBJECT_STREAM = f"OBJ_{OBJECT_BUCKET}"  # the streams JetStream keeps them in
METADATA_STREAM = f"KV_{METADATA_BUCKET}"


def tenant_key(tenant: str) -> str:
    """The tenant as one KV key token: ``.`` written ``=`` (one to one: no tenant has ``=``)."""
    return tenant.replace(".", "=")


def metadata_key(tenant: str, file_id: str) -> str:
    return f"{tenant_key(tenant)}.{file_id}"


def object_name(tenant: str, file_id: str) -> str:
    return f"{tenant}/{file_id}"
