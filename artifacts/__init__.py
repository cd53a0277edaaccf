"""Artifact plane: locating, hashing and slicing model files. Never on the token path."""
