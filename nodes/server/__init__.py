"""The node's activation server: frames over HTTP, Route Sessions, credit and forwarding."""
