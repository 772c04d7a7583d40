"""Worker snapshots: bake (snapshot.bake), manifest and checks (snapshot.manifest), the store
(snapshot.store), the CUDA driver checkpoint API (snapshot.cuda_checkpoint), CRIU detection
(snapshot.criu) and images (snapshot.criu_image), and the `snapshot-bake` CLI (snapshot.cli).
Importing this package is cheap (msgspec only); torch and cuda.bindings are imported where they
are used."""

from snapshot.manifest import (  # noqa: F401
    SnapshotCorrupt,
    SnapshotError,
    SnapshotExists,
    SnapshotManifest,
    SnapshotMismatch,
    SnapshotTarget,
    check_compatible,
    load_manifest,
    verify,
    write_snapshot,
)
