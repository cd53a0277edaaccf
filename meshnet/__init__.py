"""Meshnet: the `meshnet` command that starts and watches the parts of a mesh."""
