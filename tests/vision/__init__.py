"""Tests of images (deltaspec.model.vision, deltaspec.engine.images)."""
