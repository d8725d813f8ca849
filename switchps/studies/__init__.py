"""The packaged studies, one module each over a shared base."""
