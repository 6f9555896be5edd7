//! Host profiles, link model and projection of timelines onto them.
