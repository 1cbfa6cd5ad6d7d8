"""The gateway's roof: the Starlette app and its routes, each engine route one Exchange, and
/openapi.json."""
