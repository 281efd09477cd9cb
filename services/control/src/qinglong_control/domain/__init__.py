"""Pure domain rules of the runtime: states, fences, capabilities and command decisions.

Nothing here imports grpc or psycopg; the repository feeds it locked rows and DB time,
and the servicers translate its answers and refusals to the wire.
"""
