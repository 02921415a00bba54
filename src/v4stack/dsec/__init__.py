"""DSec: the sandbox service. Imports neither the model nor torch.

Services (each starts alone, or all three with ``v4stack dsec up``):

    apiserver.py   public HTTP API under /v1 (bearer token), placement, state in SQLite (store.py)
    edge.py        per-host agent: registers, heartbeats, runs sandboxes (runtime.py) under /edge/v1
    watcher.py     TTL and idle leases (paused time not counted), dead edges -> sandboxes 'lost' and
                   their leftovers reclaimed, garbage collection of unreferenced layers

A sandbox (runtime.py) = a root filesystem (rootfs.py: shared read-only EROFS image from images.py,
sealed layers, a tmpfs upper sized to the disk quota, overlayfs on top) + a substrate
(substrates/: ``process`` = warm pool of namespaced workers, ``container`` = one crun container per
command) + cgroup limits (cgroups.py) + a trajectory log (trajlog.py on the shared journal,
``v4stack.journal``) + an in-root files API (files.py). Snapshots seal the upper as a
content-addressed layer and record the log position; restore / fork mount any snapshot's chain.

Shared storage (``--home``, default /var/lib/v4stack-dsec):

    images/<id>.erofs, images/<recipe>.json    content-addressed images and their names
    mnt/<image-id>/                            each image mounted once, read-only
    layers/<layer-id>/                         sealed uppers (overlay whiteouts and opaque dirs kept)
    snapshots/<snap-id>.json                   {image, layers (top first), seq, parent, sandbox}
    logs/<sandbox-id>/seg-*.log                trajectory logs (journal segments)
    blobs/<sha256[:2]>/<rest>                  stdout / stderr / file contents / deltas by digest
    run/<sandbox-id>/{rw,root,bundle}          live mounts (shared-propagation bind of run/)
    dsec.sqlite                                apiserver + watcher state

Public API (all under /v1, ``Authorization: Bearer <token>``; errors are JSON
``{"error", "field", "kind"}`` with 400 / 401 / 404 / 409 / 503):

    POST   /sandboxes                      image, substrate, limits, timeout, idle_timeout, edge,
                                           snapshot_id, replay_from, rerun_idempotent, network.allow
    GET    /sandboxes[?state=]             GET /sandboxes/{id}        DELETE /sandboxes/{id}
    POST   /sandboxes/{id}/exec            cmd, cwd, env, timeout, idempotent, seq, stream (NDJSON)
    GET    /sandboxes/{id}/files?path=     PUT (raw body, &mode=)     DELETE
    GET    /sandboxes/{id}/files/list?path=                POST /sandboxes/{id}/files/upload
    POST   /sandboxes/{id}/snapshot        POST /sandboxes/{id}/restore {snapshot_id, replay_from}
    POST   /sandboxes/{id}/fork            POST /sandboxes/{id}/pause   POST /sandboxes/{id}/resume
    GET    /sandboxes/{id}/log?since=&path=    entries, unknown_outcome, provenance of path
    GET    /snapshots/{id}                 POST /edges/register          POST /edges/{id}/heartbeat
"""
