//! Just enough ELF to refuse what cannot run inside an image: a kernel that is neither an
//! ELF nor a bzImage, and a program that needs a dynamic loader the image does not have.

const ELF_MAGIC: &[u8; 4] = b"\x7fELF";
const PT_INTERP: u32 = 3;

fn bytes_at<const N: usize>(b: &[u8], at: usize) -> Option<[u8; N]> {
    b.get(at..at.checked_add(N)?)?.try_into().ok()
}
fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    bytes_at(b, at).map(u16::from_le_bytes)
}
fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    bytes_at(b, at).map(u32::from_le_bytes)
}
fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    bytes_at(b, at).map(u64::from_le_bytes)
}

/// A `vmlinux` (ELF) or a `bzImage` (the "HdrS" boot header at 0x202).
pub fn check_kernel(bytes: &[u8]) -> Result<(), String> {
    if bytes.starts_with(ELF_MAGIC) || bytes.get(0x202..0x206) == Some(b"HdrS") {
        Ok(())
    } else {
        Err("neither a vmlinux ELF nor a bzImage".into())
    }
}

/// A 64-bit little-endian x86-64 ELF executable without a PT_INTERP header.
pub fn check_static(bytes: &[u8]) -> Result<(), String> {
    if !bytes.starts_with(ELF_MAGIC) {
        return Err("not an ELF executable".into());
    }
    if bytes.get(4) != Some(&2) || bytes.get(5) != Some(&1) {
        return Err("not a 64-bit little-endian ELF".into());
    }
    if u16_at(bytes, 0x12) != Some(62) {
        return Err("not an x86-64 ELF".into());
    }
    let truncated = || "a truncated ELF header".to_owned();
    let phoff = u64_at(bytes, 0x20).ok_or_else(truncated)? as usize;
    let phentsize = u16_at(bytes, 0x36).ok_or_else(truncated)? as usize;
    let phnum = u16_at(bytes, 0x38).ok_or_else(truncated)? as usize;
    if phentsize < 4 {
        return Err("program headers too small".into());
    }
    for i in 0..phnum {
        let at = phoff
            .checked_add(i.checked_mul(phentsize).ok_or_else(truncated)?)
            .ok_or_else(truncated)?;
        let p_type = u32_at(bytes, at).ok_or("program headers beyond the file")?;
        if p_type == PT_INTERP {
            return Err(
                "dynamically linked (it names a loader the image does not have); link it \
                 statically (RUSTFLAGS=\"-C target-feature=+crt-static\")"
                    .into(),
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn static_and_dynamic_executables_are_told_apart() {
        // This test binary is dynamically linked.
        let me = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        let err = check_static(&me).unwrap_err();
        assert!(err.contains("dynamically linked"), "{err}");
        // The test guest ELF has no loader.
        check_static(agentvm_testguest::TESTGUEST_ELF).unwrap();
        check_kernel(agentvm_testguest::TESTGUEST_ELF).unwrap();
        for junk in [&b""[..], b"\x7fELF", b"#!/bin/sh\n", &[0u8; 0x300]] {
            assert!(check_static(junk).is_err());
        }
        assert!(check_kernel(b"#!/bin/sh").is_err());
        // Program headers pointing far outside the file are an error, not a panic.
        let mut bad = agentvm_testguest::TESTGUEST_ELF.to_vec();
        bad[0x20..0x28].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(check_static(&bad).is_err());
    }
}
