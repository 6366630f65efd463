"""What the emulated map's shipped rounds hold, as one JSON object (``pgc_lab.map.audit``):
``python benchmarks/map_audit.py --help``."""

from pgc_lab.map.audit import main

if __name__ == "__main__":
    main()
