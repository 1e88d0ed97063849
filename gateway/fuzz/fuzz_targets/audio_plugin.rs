#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| mmgate::fuzzing::audio_plugin(data));
