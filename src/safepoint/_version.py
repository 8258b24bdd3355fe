"""The library version, recorded in every manifest."""

__version__ = "0.1.0"
