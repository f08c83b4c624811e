"""Tools run from the repository root (`python -m tools.<name>...`), outside the runtime packages:
they import the product, nothing imports them."""
