"""Reports: results frames to self-contained HTML."""
