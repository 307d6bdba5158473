"""The OpenAI Files API: files kept in JetStream, per tenant.

``FileStore`` keeps each file in two JetStream buckets with file storage (``schemas.files``):
its bytes in an Object Store, its record (OpenAI's file object) in a KV bucket keyed by
tenant and id. The record is the commit point: written after the bytes, removed before
them. Listing one tenant's files reads the records under that tenant's key prefix only, so
one tenant never sees, reads or deletes another's files: every lookup names the caller's
tenant, and another tenant's id is simply not there (404, as for an unknown id).

Ids are ``file-`` and 24 hex digits: the creation time in milliseconds (12), then 12 random
(``FileIds``: one store's ids strictly increase), so that ids sort in creation order and a
cursor (``after``) still places a page after its file was deleted.

``files_routes`` are the HTTP routes, as the official client calls them. An upload is read
with its own limit (``--files-max-bytes``, not ``--max-body-bytes``): the form is parsed as
it arrives, its file part spooled to a temporary file past 1 MiB, and the body cut off with
a 413 once it passes the limit, so no upload costs more memory than a spool's worth. Reads
come back through a spool as well and are streamed out.

Without JetStream (or with the buckets out of reach) every route answers 503 saying so; the
rest of the ingress serves as usual, and the store tries the buckets again on the next call.
"""

from __future__ import annotations

import base64
import builtins
import hashlib
import io
import logging
import re
import secrets
import tempfile
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

import anyio
import msgspec
import nats.errors
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy, KeyValueConfig, ObjectStoreConfig, StorageType
from nats.js.errors import BadRequestError, BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from switchyard.ingress.auth import caller_of
from switchyard.ingress.errors import ApiError, InvalidRequest, RequestTimeout, RequestTooLarge, Unavailable
from switchyard.ingress.openapi import described
from switchyard.schemas import files

log = logging.getLogger(__name__)

UPLOAD_PURPOSES = ("batch", "user_data")  # what a client may upload
PURPOSES = (*UPLOAD_PURPOSES, "batch_output")  # batch_output: what the batch service writes
MAX_LIST_LIMIT = 10_000  # OpenAI's, and its default
MAX_FILENAME_CHARS = 512
_ID_RE = re.compile(r"file-[0-9a-f]{24}")
_CONFIG_IN_USE = 10058  # JetStream: a stream of that name exists with another configuration
_STREAM_NOT_FOUND = 10059
_FORM_SLACK = 64 * 1024  # what a form may add to its file's bytes (boundaries, part headers, purpose)
_STREAM_CHUNK = 256 * 1024
_CHUNK_TIMEOUT_S = 10.0  # the longest wait for the next chunk of a file being read
_LIST_TIMEOUT_S = 30.0  # the longest a listing may take to read a tenant's records


class FileObject(msgspec.Struct, frozen=True, kw_only=True):
    """OpenAI's file object, as the API returns it and the metadata bucket keeps it."""

    id: str
    object: str = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileNotFound(ApiError):
    status = 404
    type = "invalid_request_error"

    def __init__(self, file_id: str) -> None:
        super().__init__(f"No such File object: {file_id}", param="id")
        self.file_id = file_id


class FilesUnavailable(Unavailable):
    """The buckets cannot be reached: no JetStream on this server, or it does not answer."""

    def __init__(self, why: str) -> None:
        super().__init__(
            f"File storage is unavailable: it needs JetStream on the NATS server ({why}).",
            code="files_unavailable",
            retry_after_s=5.0,
        )


class FileIds:
    """``file-`` + 12 hex digits of Unix milliseconds + 12 random: ids that sort by creation.
    Within a millisecond (or if the clock steps back) the next id is the last one plus one,
    so one process's ids never fall out of order; two processes' within one millisecond
    sort arbitrarily, as their creation does."""

    _RANDOM_BITS = 48

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._last = 0

    def next(self) -> str:
        fresh = (int(self._clock() * 1000) << self._RANDOM_BITS) | secrets.randbits(self._RANDOM_BITS)
        self._last = fresh if fresh >> self._RANDOM_BITS > self._last >> self._RANDOM_BITS else self._last + 1
        return f"file-{self._last & (1 << 96) - 1:024x}"


class FileStore:
    """Files per tenant in JetStream: bytes in an Object Store, records in a KV bucket."""

    def __init__(self, js: JetStreamContext, *, max_bytes: int) -> None:
        self._js = js
        self.max_bytes = max_bytes
        self._buckets: tuple[ObjectStore, KeyValue] | None = None
        self._decoder = msgspec.json.Decoder(FileObject)
        self._ids = FileIds()

    async def ensure(self) -> None:
        """Open both buckets, creating those that are missing (file storage). A bucket that
        exists keeps its own configuration."""
        await self._open()

    async def put(self, filename: str, purpose: str, data: bytes, *, tenant: str) -> FileObject:
        return await self.put_file(filename, purpose, io.BytesIO(data), len(data), tenant=tenant)

    async def put_file(self, filename: str, purpose: str, source: IO[bytes], size: int, *, tenant: str) -> FileObject:
        """Store ``size`` bytes read from ``source`` (read in a thread, chunk by chunk)."""
        _check_new(filename, purpose)
        if size > self.max_bytes:
            raise RequestTooLarge(f"The file is {size} bytes; the limit is {self.max_bytes}.", param="file")
        objects, records = await self._open()
        file = FileObject(
            id=self._ids.next(), bytes=size, created_at=int(time.time()), filename=filename, purpose=purpose
        )
        with self._bus_errors():
            info = await objects.put(files.object_name(tenant, file.id), source)  # type: ignore[arg-type]
            assert info.size == size, (info.size, size)
            await records.put(files.metadata_key(tenant, file.id), msgspec.json.encode(file))
        return file

    async def info(self, file_id: str, *, tenant: str) -> FileObject:
        if not _ID_RE.fullmatch(file_id):  # also keeps wildcards and dots out of the key
            raise FileNotFound(file_id)
        _, records = await self._open()
        with self._bus_errors():
            try:
                entry = await records.get(files.metadata_key(tenant, file_id))
            except NotFoundError:  # never written, deleted, or another tenant's
                raise FileNotFound(file_id) from None
        assert entry.value is not None
        return self._decoder.decode(entry.value)

    async def read(self, file_id: str, *, tenant: str) -> bytes:
        out = io.BytesIO()
        await self.read_into(file_id, out, tenant=tenant)
        return out.getvalue()

    async def read_into(self, file_id: str, out: IO[bytes], *, tenant: str) -> FileObject:
        """Write the file's bytes into ``out`` (in a thread, chunk by chunk); its record."""
        file = await self.info(file_id, tenant=tenant)
        objects, _ = await self._open()
        with self._bus_errors():
            try:
                await self._copy(objects, files.object_name(tenant, file_id), out)
            except NotFoundError:  # deleted since its record was read
                raise FileNotFound(file_id) from None
        return file

    async def _copy(self, objects: ObjectStore, name: str, out: IO[bytes]) -> None:
        """An object's chunks into ``out``, their digest checked. Not ``ObjectStore.get``, which
        looks the stream up by subject: a right to list every stream's name."""
        info = await objects.get_info(name)
        if not info.size:
            return
        digest = hashlib.sha256()
        sub = await self._js.subscribe(
            f"$O.{files.OBJECT_BUCKET}.C.{info.nuid}", stream=files.OBJECT_STREAM, ordered_consumer=True
        )
        try:
            while True:  # each chunk within the timeout: chunks purged meanwhile never come
                msg = await sub.next_msg(timeout=_CHUNK_TIMEOUT_S)
                digest.update(msg.data)
                await anyio.to_thread.run_sync(out.write, msg.data)
                if msg.metadata.num_pending == 0:
                    break
        finally:
            await sub.unsubscribe()
        stored = base64.urlsafe_b64decode((info.digest or "").partition("=")[2])
        if digest.digest() != stored:
            raise FilesUnavailable(f"the bytes of {name} do not match their digest")

    async def list(
        self,
        *,
        tenant: str,
        purpose: str | None = None,
        after: str | None = None,
        limit: int = MAX_LIST_LIMIT,
        order: str = "desc",
    ) -> tuple[list[FileObject], bool]:
        """One page of the tenant's files, newest first (``desc``) or oldest first, after the
        file ``after`` (which need not exist any more); and whether more follow."""
        assert order in ("asc", "desc") and limit > 0, (order, limit)
        found = [f for f in await self._all(tenant) if purpose is None or f.purpose == purpose]
        found.sort(key=lambda f: f.id, reverse=order == "desc")
        if after is not None:
            found = [f for f in found if (f.id < after if order == "desc" else f.id > after)]
        return found[:limit], len(found) > limit

    async def delete(self, file_id: str, *, tenant: str) -> bool:
        """Remove the file: its record first, then its bytes. False: the tenant has no such file."""
        try:
            await self.info(file_id, tenant=tenant)
        except FileNotFound:
            return False
        objects, records = await self._open()
        with self._bus_errors():
            await records.delete(files.metadata_key(tenant, file_id))
            try:
                await objects.delete(files.object_name(tenant, file_id))
            except NotFoundError:  # a concurrent delete took the bytes first
                pass
        return True

    # --- the buckets ----------------------------------------------------------------------------

    @contextmanager
    def _bus_errors(self) -> Iterator[None]:
        """What the bus raises, as the 503 a client can act on (NotFound is each caller's
        own). The buckets are looked up again on the next call: a server that lost its store
        gets them created anew."""
        try:
            yield
        except NotFoundError as exc:
            if exc.err_code != _STREAM_NOT_FOUND:
                raise
            self._buckets = None
            raise FilesUnavailable("its buckets are gone; they are made again on the next call") from None
        except (TimeoutError, nats.errors.Error) as exc:  # nats-py's timeouts are both
            self._buckets = None
            raise FilesUnavailable(type(exc).__name__ if not str(exc) else str(exc).strip()) from None

    async def _open(self) -> tuple[ObjectStore, KeyValue]:
        if self._buckets is None:
            with self._bus_errors():
                self._buckets = (await self._objects(), await self._records())
            log.info("file storage: buckets %s and %s", files.OBJECT_BUCKET, files.METADATA_BUCKET)
        return self._buckets

    async def _objects(self) -> ObjectStore:
        try:
            return await self._js.object_store(files.OBJECT_BUCKET)
        except BucketNotFoundError:
            pass
        config = ObjectStoreConfig(description="Switchyard: the Files API's bytes", storage=StorageType.FILE)
        try:
            return await self._js.create_object_store(files.OBJECT_BUCKET, config=config)
        except BadRequestError as exc:
            if exc.err_code != _CONFIG_IN_USE:  # else another process created it just now
                raise
            return await self._js.object_store(files.OBJECT_BUCKET)

    async def _records(self) -> KeyValue:
        try:
            return await self._js.key_value(files.METADATA_BUCKET)
        except BucketNotFoundError:
            pass
        config = KeyValueConfig(
            bucket=files.METADATA_BUCKET,
            description="Switchyard: the Files API's file objects",
            history=1,
            storage=StorageType.FILE,
        )
        try:
            return await self._js.create_key_value(config)
        except BadRequestError as exc:
            if exc.err_code != _CONFIG_IN_USE:
                raise
            return await self._js.key_value(files.METADATA_BUCKET)

    async def _all(self, tenant: str) -> builtins.list[FileObject]:  # list: the method's name here
        """Every record of the tenant: the latest message per key under its prefix, from one
        ordered consumer. How many to read is the consumer's own count at its start (delivered
        plus pending, on the server), not nats-py's KV watcher, whose "caught up" marker can
        come before messages still on their way."""
        await self._open()
        found: builtins.list[FileObject] = []
        with self._bus_errors(), anyio.fail_after(_LIST_TIMEOUT_S):
            sub = await self._js.subscribe(
                f"$KV.{files.METADATA_BUCKET}.{files.tenant_key(tenant)}.*",
                stream=files.METADATA_STREAM,
                ordered_consumer=True,
                deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
            )
            try:
                start = await sub.consumer_info()
                delivered = (start.delivered.consumer_seq or 0) if start.delivered else 0
                for _ in range(delivered + (start.num_pending or 0)):
                    msg = await sub.next_msg(timeout=_CHUNK_TIMEOUT_S)
                    if msg.data and (msg.headers or {}).get("KV-Operation") is None:  # not a delete
                        found.append(self._decoder.decode(msg.data))
            finally:
                await sub.unsubscribe()
        return found


def _check_new(filename: str, purpose: str) -> None:
    if purpose not in PURPOSES:
        raise InvalidRequest(
            f"`purpose` must be one of {', '.join(UPLOAD_PURPOSES)}, got {purpose!r}.", param="purpose"
        )
    if not 0 < len(filename) <= MAX_FILENAME_CHARS:
        raise InvalidRequest(f"The file's name must be 1 to {MAX_FILENAME_CHARS} characters.", param="file")


# --- HTTP -----------------------------------------------------------------------------------------


def files_routes(store: Callable[[], FileStore]) -> list[Route]:
    """``/v1/files`` and below, each behind the ingress's AuthMiddleware (it covers ``/v1/``)."""
    api = _FilesApi(store)
    return [
        Route("/v1/files", api.upload, methods=["POST"]),
        Route("/v1/files", api.list, methods=["GET"]),
        Route("/v1/files/{file_id}", api.retrieve, methods=["GET"]),
        Route("/v1/files/{file_id}", api.delete, methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", api.content, methods=["GET"]),
    ]


_FILE_ID = {"name": "file_id", "in": "path", "required": True, "schema": {"type": "string"}}
_NOT_FOUND = {"404": "no such file for this caller (another tenant's files are not there for it)"}
_UNAVAILABLE = {"503": "file storage is unavailable (no JetStream), or see the edge's reasons"}
_UPLOAD = {
    "required": True,
    "content": {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "required": ["file", "purpose"],
                "properties": {
                    "file": {"type": "string", "format": "binary"},
                    "purpose": {"type": "string", "enum": list(UPLOAD_PURPOSES)},
                },
            }
        }
    },
}
_LIST_PARAMETERS = [
    {"name": "purpose", "in": "query", "schema": {"type": "string"}},
    {"name": "after", "in": "query", "schema": {"type": "string"}},
    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": MAX_LIST_LIMIT}},
    {"name": "order", "in": "query", "schema": {"type": "string", "enum": ["asc", "desc"]}},
]


class _FilesApi:
    def __init__(self, store: Callable[[], FileStore]) -> None:
        self._store = store

    @described(
        summary="Upload a file (multipart/form-data: file, purpose)",
        requestBody=_UPLOAD,
        errors={"400": "not a form, no file or purpose, a purpose not accepted", "413": "over --files-max-bytes"}
        | _UNAVAILABLE,
    )
    async def upload(self, request: Request) -> Response:
        """Upload a file (multipart/form-data: file, purpose)"""
        store = self._store()
        tenant = caller_of(request).tenant
        form = await _read_form(request, store.max_bytes)
        try:
            purpose, upload = _form_fields(form)
            size = upload.size if upload.size is not None else 0
            if size > store.max_bytes:
                raise RequestTooLarge(f"The file is {size} bytes; the limit is {store.max_bytes}.", param="file")
            upload.file.seek(0)
            file = await store.put_file(upload.filename or "file", purpose, upload.file, size, tenant=tenant)
        finally:
            await form.close()
        return _json(file)

    @described(
        summary="The caller's files, newest first, in pages",
        parameters=_LIST_PARAMETERS,
        errors={"400": "a limit or order out of range"} | _UNAVAILABLE,
    )
    async def list(self, request: Request) -> Response:
        """The caller's files, newest first (order=asc: oldest), in pages (after, limit)"""
        query = request.query_params
        limit = _limit(query.get("limit"))
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise InvalidRequest(f"`order` must be asc or desc, got {order!r}.", param="order")
        page, more = await self._store().list(
            tenant=caller_of(request).tenant,
            purpose=query.get("purpose"),
            after=query.get("after"),
            limit=limit,
            order=order,
        )
        body = {
            "object": "list",
            "data": page,
            "has_more": more,
            "first_id": page[0].id if page else None,
            "last_id": page[-1].id if page else None,
        }
        return Response(msgspec.json.encode(body), media_type="application/json")

    @described(summary="One of the caller's files", parameters=[_FILE_ID], errors=_NOT_FOUND | _UNAVAILABLE)
    async def retrieve(self, request: Request) -> Response:
        """One of the caller's files"""
        return _json(await self._store().info(request.path_params["file_id"], tenant=caller_of(request).tenant))

    @described(summary="Delete one of the caller's files", parameters=[_FILE_ID], errors=_NOT_FOUND | _UNAVAILABLE)
    async def delete(self, request: Request) -> Response:
        """Delete one of the caller's files"""
        file_id = request.path_params["file_id"]
        if not await self._store().delete(file_id, tenant=caller_of(request).tenant):
            raise FileNotFound(file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    @described(
        summary="The bytes of one of the caller's files",
        parameters=[_FILE_ID],
        content={"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        errors=_NOT_FOUND | _UNAVAILABLE,
    )
    async def content(self, request: Request) -> Response:
        """The bytes of one of the caller's files"""
        spool = tempfile.SpooledTemporaryFile(max_size=1024 * 1024)
        try:
            await self._store().read_into(request.path_params["file_id"], spool, tenant=caller_of(request).tenant)
        except BaseException:
            spool.close()
            raise
        return StreamingResponse(_drain(spool), media_type="application/octet-stream")


async def _drain(spool: IO[bytes]) -> AsyncIterator[bytes]:
    try:
        spool.seek(0)
        while chunk := await anyio.to_thread.run_sync(spool.read, _STREAM_CHUNK):
            yield chunk
    finally:
        spool.close()


async def _read_form(request: Request, max_bytes: int) -> Any:
    content_type = request.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        raise InvalidRequest(
            "An upload must be multipart/form-data with the fields `file` and `purpose`.", param="file"
        )
    limit = max_bytes + _FORM_SLACK
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise RequestTooLarge(f"The upload is {declared} bytes; the limit for a file is {max_bytes}.", param="file")
    parser = MultiPartParser(request.headers, _bounded(request, limit, max_bytes), max_files=1)
    try:
        return await parser.parse()
    except MultiPartException as exc:
        raise InvalidRequest(f"The upload is not a valid form: {exc.message}", param="file") from None
    except ClientDisconnect:  # gone, or cut off by the edge's body deadline (ingress.edge)
        raise RequestTimeout("The upload did not arrive in full.") from None


async def _bounded(request: Request, limit: int, max_bytes: int) -> AsyncGenerator[bytes, None]:
    size = 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise RequestTooLarge(f"The upload exceeds the limit for a file of {max_bytes} bytes.", param="file")
        yield part


def _form_fields(form: Any) -> tuple[str, UploadFile]:
    purpose, upload = form.get("purpose"), form.get("file")
    if not isinstance(purpose, str):
        raise InvalidRequest("The form needs a `purpose` field.", param="purpose")
    if purpose not in UPLOAD_PURPOSES:
        raise InvalidRequest(
            f"`purpose` must be one of {', '.join(UPLOAD_PURPOSES)}, got {purpose!r}.", param="purpose"
        )
    if not isinstance(upload, UploadFile):
        raise InvalidRequest("The form needs a `file` part, sent as a file.", param="file")
    return purpose, upload


def _limit(value: str | None) -> int:
    if value is None:
        return MAX_LIST_LIMIT
    if not value.isdigit() or not 1 <= int(value) <= MAX_LIST_LIMIT:
        raise InvalidRequest(f"`limit` must be an integer from 1 to {MAX_LIST_LIMIT}, got {value!r}.", param="limit")
    return int(value)


def _json(file: FileObject) -> Response:
    return Response(msgspec.json.encode(file), media_type="application/json")
