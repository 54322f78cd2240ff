"""The project's images built from its Dockerfile without a Docker daemon.

BuildKit (built from its Go module, :mod:`.buildkit`) with the containerd worker builds the Dockerfile's
``control-plane`` and ``worker-cpu`` targets straight into a containerd's image store (the local real
node's, namespace ``k8s.io``), on a Debian base made locally with mmdebstrap (:mod:`.base`), since no
image registry is reachable. :func:`ensure_images` is the one entry point; ``python -m disagg.e2e.images
--containerd-socket PATH`` runs it from a shell.
"""

from .build import TARGETS, ImageBuildError, ensure_images

__all__ = ["TARGETS", "ImageBuildError", "ensure_images"]
