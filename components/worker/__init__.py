"""Worker: one DP/EP rank as a Dynamo process.

Serves two endpoints: `<ns>.worker.generate` (registered with the model, so the frontend routes
to it once it is routable) and `<ns>.worker.control` (the router's commands, addressed to this
instance). A rank starts out of routing; the router makes it routable after it joined a group.
"""
