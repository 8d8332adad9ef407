"""The status page: GET / and its static files, shipped as package data (no build step, no
CDN, nothing fetched from elsewhere: it works on a box with no internet). The page holds no data
and needs no key; everything it shows comes from the keyed JSON API and GET /api/events."""

from __future__ import annotations

import functools
from importlib import resources

from aiohttp import hdrs, web

from hal0d.errors import NoRoute

FILES = {
    "index.html": "text/html",
    "app.css": "text/css",
    "app.js": "text/javascript",
    "state.js": "text/javascript",
    "api.js": "text/javascript",
    "format.js": "text/javascript",
    "header.js": "text/javascript",
    "slots.js": "text/javascript",
    "hour.js": "text/javascript",
    "requests.js": "text/javascript",
    "refresh.js": "text/javascript",
    "feed.js": "text/javascript",
    "charts.js": "text/javascript",
    "groups.js": "text/javascript",
    "devices.js": "text/javascript",
    "keys.js": "text/javascript",
}
# Revalidated on every load, so an upgraded hal0d serves its new page at once.
CACHE = {hdrs.CACHE_CONTROL: "no-cache", "X-Content-Type-Options": "nosniff"}


@functools.cache
def read(name: str) -> bytes:
    return resources.files("hal0d").joinpath("static", name).read_bytes()


async def index(request: web.Request) -> web.Response:
    return web.Response(body=read("index.html"), content_type=FILES["index.html"],
                        charset="utf-8", headers=CACHE)


async def static(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in FILES:
        raise NoRoute(f"no such file: /static/{name}")
    return web.Response(body=read(name), content_type=FILES[name], charset="utf-8",
                        headers=CACHE)
