"""The batch tier: the OpenAI Files and Batch APIs on spare capacity, persisted in SQLite.

- `store`: files (bytes on disk, rows in SQLite), batches and their lines; the one place state
  lives, so a batch survives a restart and resumes where it stopped.
- `jsonl`: reading and validating a batch input file (limits checked before any work).
- `lines`: runs one line through the same admission and engine as a live request.
- `gate`: decides how many lines may run now without delaying interactive traffic.
- `executor`: the background task that feeds lines, records results, finalizes, expires, cancels.
- `routes`: `/v1/files` and `/v1/batches` in OpenAI's shapes, tenant-scoped.
- `offline`: `batcher batch run FILE.jsonl`, the same engine in-process with no server.
- `metrics`: lines queued / running / done and tokens served from spare capacity.
"""
