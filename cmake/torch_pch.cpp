// Anchor translation unit of the precompiled torch header (see KilnDeps.cmake).
