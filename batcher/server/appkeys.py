"""Typed keys of the replica's aiohttp application state, in a module of their own so that route
modules can read the gateway without importing the app that mounts them."""

from __future__ import annotations

from aiohttp import web

from batcher.server.gateway import Gateway

GATEWAY = web.AppKey("gateway", Gateway)
