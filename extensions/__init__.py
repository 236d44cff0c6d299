"""Plugin machinery: entry-point loading (``plugins``), function hooks (``hooks``) and
their stable surface (``surface``), message interceptors, and the registry of every
extension point (``points``). ``API_VERSION`` is the version of that plugin surface."""

from .surface import API_VERSION

__all__ = ["API_VERSION"]
