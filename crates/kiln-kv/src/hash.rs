//! Block hashes for the prefix cache: 64-bit FNV-1a chained over (parent hash, token ids).
//!
//! Written out explicitly because `std`'s `DefaultHasher` may change between Rust releases,
//! and cached hashes should mean the same thing in every build.

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// The parent hash of a sequence's first block.
pub(crate) const ROOT_HASH: u64 = FNV_OFFSET;

fn fnv1a(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(FNV_PRIME);
    }
    h
}

/// Hash of one full block given the hash of the block before it ([`ROOT_HASH`] for the first).
pub(crate) fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = fnv1a(FNV_OFFSET, &parent.to_le_bytes());
    for t in tokens {
        h = fnv1a(h, &t.to_le_bytes());
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_matches_published_vectors() {
        // Test vectors of the FNV reference (isthe.com/chongo/tech/comp/fnv).
        assert_eq!(fnv1a(FNV_OFFSET, b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(FNV_OFFSET, b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(FNV_OFFSET, b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn chain_depends_on_parent_and_tokens() {
        let a = block_hash(ROOT_HASH, &[1, 2, 3, 4]);
        assert_eq!(a, block_hash(ROOT_HASH, &[1, 2, 3, 4]));
        assert_ne!(a, block_hash(ROOT_HASH, &[1, 2, 3, 5]));
        assert_ne!(block_hash(a, &[1, 2, 3, 4]), a);
        assert_ne!(block_hash(a, &[5]), block_hash(ROOT_HASH, &[5]));
    }
}
