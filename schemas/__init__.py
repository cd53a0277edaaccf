"""Contracts: pydantic models of everything that crosses a process boundary."""
