"""Entry point of the export helper process: ``python -m zoomer_serve.export.helper``."""

from zoomer_serve.export.worker import main

if __name__ == "__main__":
    main()
