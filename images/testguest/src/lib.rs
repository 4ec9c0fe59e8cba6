//! The freestanding test guest ELF, embedded.
